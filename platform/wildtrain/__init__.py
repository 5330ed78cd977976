"""wildtrain: elastic LLM training on Ray + DeepSpeed for clusters that fail."""
