//go:build !unix

package files

// nonBlocking is nothing where opening a path cannot wait for a writer this way.
const nonBlocking = 0
