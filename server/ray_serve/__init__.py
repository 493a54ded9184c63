"""specserve replicas on Ray Serve (an optional extra: ``pip install 'specserve[ray]'``)."""
