"""The history: a sink from the event topics into ClickHouse, its read-only SQL server and dashboard, the
guard every query passes, replay, and their commands."""
