"""The data side: listing a dataset (sources), any fsspec storage, the output root's layout, content fingerprints,
leases on shared folders, the local cache."""
