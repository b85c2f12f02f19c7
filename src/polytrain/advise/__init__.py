"""``polytrain advise``: a cost model of each strategy (:mod:`.model`), fed by short runs on this machine
(:mod:`.measure`), and its ranked recommendation (:mod:`.report`). docs/choosing.md explains the model."""
