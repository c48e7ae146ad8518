package fetch

import "sync"

// recvBuffers keeps the buffers range responses were received into once
// their flights are over, for the next flights of the node. Like decoded
// frames (frameSlots), a new buffer is memory the daemon has never
// touched, one page fault per 4 KiB: on the 2-core VMs here that was about
// a fifth of the daemon's CPU in a cold read of a large file, for bytes
// that are hashed, decoded and written to the node cache within
// milliseconds and then dropped.
type recvBuffers struct {
	mu    sync.Mutex
	free  map[int][][]byte // by capacity: recvClass multiples
	bytes int
}

const (
	// recvClass rounds buffer sizes up, so that flights of about one
	// frame (1-2 MiB compressed) and fill batches each find buffers
	// their size.
	recvClass = 1 << 20
	// maxRecvKept bounds the bytes of buffers kept between flights:
	// three fill batches and the reads beside them.
	maxRecvKept = 48 << 20
)

// get returns a buffer of n bytes.
func (p *recvBuffers) get(n int64) []byte {
	size := int((n + recvClass - 1) / recvClass * recvClass)
	p.mu.Lock()
	if l := p.free[size]; len(l) > 0 {
		b := l[len(l)-1]
		p.free[size] = l[:len(l)-1]
		p.bytes -= size
		p.mu.Unlock()
		return b[:n]
	}
	p.mu.Unlock()
	return make([]byte, n, size)
}

// put keeps b for a later get; nothing may read or write b any more.
func (p *recvBuffers) put(b []byte) {
	size := cap(b)
	if size%recvClass != 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bytes+size > maxRecvKept {
		return
	}
	if p.free == nil {
		p.free = map[int][][]byte{}
	}
	p.free[size] = append(p.free[size], b[:0])
	p.bytes += size
}
