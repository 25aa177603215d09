"""The model: config, architectures (weight-name maps), the transformer itself."""
