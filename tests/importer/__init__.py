"""torch.nn, Hugging Face and ONNX networks in: import, verify, the one-call API."""
