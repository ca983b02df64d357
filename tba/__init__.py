"""tba: offload PyTorch activations to NVMe files and prefetch them for backward."""
