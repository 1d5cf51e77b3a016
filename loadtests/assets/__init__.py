"""Generators of the documentation's pictures: the status page's screenshot and the Grafana dashboard's panels."""
