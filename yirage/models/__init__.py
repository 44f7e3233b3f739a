"""Model builders: Hugging Face checkpoints -> yirage PersistentKernels."""
