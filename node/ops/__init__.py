"""What an operator sets, sees and keeps: config, checkpoints, metrics and logs, the status server, progress,
resources."""
