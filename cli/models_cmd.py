"""digen CLI commands: models_cmd (registered on cli.main.app)."""
