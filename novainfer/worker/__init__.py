"""Worker and model runner: execute one scheduled step on one device."""
