"""Built-in synthetic tasks (prompt generators and their rewards)."""
