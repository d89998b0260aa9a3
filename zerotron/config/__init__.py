"""Configuration: one typed schema, loaders for Megatron flags, DeepSpeed JSON and YAML/JSON."""
