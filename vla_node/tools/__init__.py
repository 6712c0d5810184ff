"""Command-line tools: benchmark, replay evaluator, demo."""
