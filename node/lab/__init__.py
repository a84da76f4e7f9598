"""The lab: multi-seed experiments over I/J configurations and the statistics, figures and report that compare them."""
