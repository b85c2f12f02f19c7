"""A model's weights in and out: where a run's weights come from (``--init-from``, ``--model hf:DIR``), read by
each rank only as far as it holds them (:mod:`.sources`, :mod:`.fill`), and written back in Hugging Face's
format without ever holding the whole model in one process (:mod:`.export`)."""
