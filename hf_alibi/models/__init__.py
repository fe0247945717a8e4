"""The model families whose code ships with their checkpoints: one folder each, flat, imported only relatively."""
