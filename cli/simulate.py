"""digen CLI commands: simulate (registered on cli.main.app)."""
