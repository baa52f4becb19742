"""Text sources for perplexity and calibration (METHODS.md §1.2, §9.1; DESIGN.md §5)."""
