"""The worker: scheduler, radix cache, memory pools and model runner for one device (one TP rank)."""
