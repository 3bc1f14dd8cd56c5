"""The model classes, one file per architecture family; model_loader.py's MODEL_REGISTRY maps a
checkpoint's `architectures` name to its class."""
