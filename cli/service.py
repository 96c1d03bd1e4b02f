"""digen CLI commands: service (registered on cli.main.app)."""
