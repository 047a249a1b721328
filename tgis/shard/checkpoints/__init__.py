"""Model files: which files are weights (``weight_files``), find and fetch them (``hub``),
convert ``.bin`` to safetensors (``convert``), read ``config.json`` (``model_config``), load
tensors by name (``weights``) or make random ones (``dummy_weights``)."""
