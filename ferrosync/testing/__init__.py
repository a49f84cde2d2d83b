"""Servers and proxies the test suite and the tools start (stdlib imports only at module
level; never imported by ``import ferrosync``)."""
