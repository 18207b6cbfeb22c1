"""TRL integration: AsyncGRPOTrainer with delta weight sync."""
