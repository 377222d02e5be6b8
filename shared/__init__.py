"""Code both sides of kvpark share: the generated contract, the wire framing of the data path,
ids, CRC32C and the package version."""
