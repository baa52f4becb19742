"""What a job leaves behind: ``result.json`` (:mod:`.results`, the contract of docs/design.md §4), its
identity (:mod:`.identity`), W&B tracking (:mod:`.tracking`), the console summary
(:mod:`.summary`), console logging (:mod:`.logs`), and the cache shared by parallel jobs
(:mod:`.cache`)."""
