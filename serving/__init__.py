"""The front door: completions, feedback ingest, auth, weight pickup."""
