"""Many clusters: the registry of clusters (`registry`), checking one (`check`), sending a
run to one (`submit`), copying between their stores (`sync`)."""
