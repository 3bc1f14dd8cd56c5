"""radixserve services: gateway, tokenizer, worker (scheduler + model runner), detokenizer."""
