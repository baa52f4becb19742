"""Text sources for perplexity and calibration (docs/methods.md §1.2, §9.1; docs/design.md §5)."""
