"""PersistentKernel: an LLM decode step as one task graph of workers' tasks and events."""
