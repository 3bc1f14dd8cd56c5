"""The tokenizer service: text or chat messages -> token ids, validated, forwarded to the chosen worker."""
