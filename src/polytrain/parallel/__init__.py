"""How one replica of the model is cut over ranks: fully sharded data parallel (:mod:`.fsdp`), pipeline stages
(:mod:`.pp`), tensor parallel (:mod:`.tp`), and the memory each rank holds (:mod:`.memory_plan`)."""
