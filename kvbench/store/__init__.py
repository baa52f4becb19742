"""What a job leaves behind: ``result.json`` (:mod:`.results`, the contract of docs/design.md §4), its
identity (:mod:`.identity`), the allocation figure beside it (:mod:`.figures`), its W&B run
(:mod:`.tracking`: opened by :mod:`.wandb_run`, named and filled from :mod:`.wandb_keys` and
:mod:`.wandb_tables`), the console summary (:mod:`.summary`), console logging (:mod:`.logs`), and
the cache shared by parallel jobs (:mod:`.cache`)."""
