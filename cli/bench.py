"""digen CLI commands: bench (registered on cli.main.app)."""
