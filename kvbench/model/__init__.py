"""The model side of a job: loading (:mod:`.loading`), putting a method into it
(:mod:`.integrate`: ``with attached(model, method):``), the compressed LM the tasks and the
held-out searches score through (:mod:`.compressed_lm`) and the perplexity loop (:mod:`.perplexity`)."""
