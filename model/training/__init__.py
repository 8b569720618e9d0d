"""Training a small Llama from text on CPU, and its CLI (`lmserve train`)."""
