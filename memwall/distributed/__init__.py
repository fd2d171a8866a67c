"""memwall/distributed: collectives and process groups for tensor/pipeline/data parallel."""
