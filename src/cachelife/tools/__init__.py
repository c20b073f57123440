"""Tools around the library: small models built from configs in code (`zoo`), the compiled-forward recipe
(`recipe`), the demo (`demo`) and the command line (`cli`)."""
