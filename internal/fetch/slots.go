package fetch

import (
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// frameSlots holds the memory decoded frames of up to slotFrame bytes are
// decoded into: one anonymous mapping, advised for transparent huge pages,
// cut into slots that are reused for as long as the cache lives.
//
// Why not the Go heap: a cold read of a large file decodes a new 2 MiB
// frame per miss into memory the process has never touched, and every
// 4 KiB page of it is a page fault. On the 2-core VMs these numbers come
// from a fault costs about 20 microseconds (a 64 MiB first touch: 370 ms
// in 4 KiB pages, 5-15 ms in huge pages), and BenchmarkColdBigBinary took
// 29,000 of them in its 1.2 s of daemon CPU: about half of it. A slot is
// one huge page when the kernel can give one (THP "madvise" or "always"),
// and once touched it stays resident and is written again by the next
// frame, so a node pays the first touch once per slot, not once per frame.
type frameSlots struct {
	mem  []byte // the whole mapping, unmapped once no frame holds s
	base int    // offset in mem of slot 0, huge-page aligned
	n    int

	mu   sync.Mutex
	free []int // LIFO: the slot freed last is the one most likely resident
	next int   // slots below it have been handed out at least once
}

const (
	hugePage = 2 << 20
	// slotStride is what a slot takes of the address space: a huge page
	// for the frame and the next one, of which only the first 4 KiB page
	// is ever touched, for the decoder's slack past the frame's end.
	slotStride = 2 * hugePage
	// slotFrame is the largest frame that fits a slot (the default chunk
	// size; layerfmt.FrameBufferSize adds the slack, within the first
	// page past it).
	slotFrame = hugePage
	pageSize  = 4096
	// minSlotFrame: smaller frames stay on the Go heap, where they take
	// what they need rather than a huge page each.
	minSlotFrame = 1 << 20
	// spareSlots are slots beyond the cache's bound: frames evicted while
	// a reader still holds them, and frames being decoded.
	spareSlots = 16
)

// newFrameSlots maps slots for a cache of max bytes, or returns nil when
// the mapping fails (frames then stay on the Go heap). The slots the cache
// can fill are faulted in the background (populate).
func newFrameSlots(max int64) *frameSlots {
	n := int(max/slotFrame) + spareSlots
	// MAP_NORESERVE: only touched slots cost memory: those populate
	// faults in, and spares while frames are held past their eviction.
	mem, err := unix.Mmap(-1, 0, n*slotStride+hugePage, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil
	}
	base := 0
	if r := int(uintptr(unsafe.Pointer(unsafe.SliceData(mem))) % hugePage); r != 0 {
		base = hugePage - r
	}
	s := &frameSlots{mem: mem, base: base, n: n}
	for i := range n {
		// Only the frame's huge page: the slack past it must stay a
		// 4 KiB page, not a second huge page per slot. Without THP
		// (or with it set to "never") the advice is ignored, and slots
		// still save the faults of every frame after a slot's first.
		_ = unix.Madvise(s.slot(i, hugePage), unix.MADV_HUGEPAGE)
	}
	go s.populate(int(max / slotFrame))
	return s
}

// slot returns the first size bytes of slot i.
func (s *frameSlots) slot(i, size int) []byte {
	off := s.base + i*slotStride
	return s.mem[off : off+size : off+size]
}

// populate faults in the first n slots (MADV_POPULATE_WRITE, which maps
// the pages without writing to them, so it is safe on slots already in
// use). A first touch is the expensive part of a slot: on the VMs here
// (a throwaway measurement) decoding a 2 MiB frame into a slot never
// touched took 6.7 ms, into one populated or used before 2.5-4.3 ms. A
// node pays that once, at start, rather than in its first environment's
// cold reads. Kernels before 5.14 do not know the advice; their slots are
// faulted in by their first frames.
func (s *frameSlots) populate(n int) {
	for i := range min(n, s.n) {
		if err := unix.Madvise(s.slot(i, slotFrame+pageSize), unix.MADV_POPULATE_WRITE); err != nil {
			return
		}
	}
}

// get returns a free slot's buffer of capacity size, or ok false when
// every slot is taken.
func (s *frameSlots) get(size int) (buf []byte, slot int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case len(s.free) > 0:
		slot = s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
	case s.next < s.n:
		slot = s.next
		s.next++
	default:
		return nil, 0, false
	}
	return s.slot(slot, size), slot, true
}

// put frees slot for the next frame; nothing may hold its bytes any more.
func (s *frameSlots) put(slot int) {
	s.mu.Lock()
	s.free = append(s.free, slot)
	s.mu.Unlock()
}

func unmap(mem []byte) { _ = unix.Munmap(mem) }
