"""The transformers fallback engine: any ``AutoModelForCausalLM`` or
``AutoModelForSeq2SeqLM`` behind the same ``Runner`` interface, without paging."""
