"""specserve HTTP server, protocol models and the `specserve` command line."""
