"""Settings, the local Kafka, the Kafka layer, the CLI."""
