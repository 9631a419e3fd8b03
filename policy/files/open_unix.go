//go:build unix

package files

import "syscall"

// nonBlocking opens a FIFO at once instead of waiting for a writer; reading a regular file is
// not affected by it.
const nonBlocking = syscall.O_NONBLOCK
