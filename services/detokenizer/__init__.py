"""The detokenizer service: each worker step's token ids -> text deltas, batched per gateway."""
