"""What one peer does alone: tasks and rewards, the model (sampling, log-probs), the GRPO loss, the trainer, groups."""
