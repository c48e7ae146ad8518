package layerfmt

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// EntryType is the kind of a TOC entry, mirroring the tar type flags OCI
// layers use.
type EntryType uint8

// Entry types. The zero value is invalid so that a zeroed record is caught.
const (
	TypeReg EntryType = iota + 1
	TypeDir
	TypeSymlink
	TypeHardlink
	TypeChar
	TypeBlock
	TypeFIFO
)

func (t EntryType) String() string {
	switch t {
	case TypeReg:
		return "reg"
	case TypeDir:
		return "dir"
	case TypeSymlink:
		return "symlink"
	case TypeHardlink:
		return "hardlink"
	case TypeChar:
		return "char"
	case TypeBlock:
		return "block"
	case TypeFIFO:
		return "fifo"
	}
	return fmt.Sprintf("EntryType(%d)", uint8(t))
}

// Entry is the decoded metadata of one TOC entry.
type Entry struct {
	// Name is cleaned and relative, with no leading "/" or "./"; the root
	// directory is ".".
	Name string
	Type EntryType
	// Mode holds permission bits, fs.ModeSetuid/ModeSetgid/ModeSticky and
	// the type bits matching Type (hard links carry no type bits: they are
	// whatever their target is).
	Mode     fs.FileMode
	UID, GID int
	// Size is the size of a regular file; 0 for every other type,
	// including hard links (use TOC.Resolve to reach the target).
	Size    int64
	ModTime time.Time
	// Linkname is the symlink target verbatim, or the hard-link target path
	// cleaned like Name.
	Linkname           string
	Devmajor, Devminor uint32
	// Xattrs holds extended attributes (including security.capability);
	// nil when there are none.
	Xattrs map[string]string
	// Implicit is set for directories that were not in the tar stream but
	// are implied by the paths of their descendants (including a root
	// "." the tar did not contain). Their metadata is synthetic: mode 0755,
	// owner 0:0, mtime zero (Unix epoch).
	Implicit bool
}

// Raw TOC layout; see docs/layer-format.md.
const (
	tocMagic       = "ESNAPTOC"
	tocHeaderSize  = 64
	entryRecSize   = 96
	chunkRecSize   = 64
	xattrRecSize   = 16
	flagImplicit   = 1
	unixModeMask   = 0o7777
	maxXattrKeyLen = 255
	maxXattrValLen = 1 << 16
)

// TOC is a decoded table of contents. It keeps the decompressed TOC bytes
// and reads fixed-size records from them on demand, so its memory is the
// raw TOC size and it holds no Go string or map per entry.
//
// Entries are in breadth-first order: index 0 is the root ".", and the
// children of every directory have consecutive indexes, sorted by name.
type TOC struct {
	entries []byte
	chunks  []byte
	xattrs  []byte
	strs    []byte
	n       int
	dataEnd int64
}

// tocDecoders are streaming decoders: the TOC is decompressed as it is
// read, so memory follows the bytes actually produced rather than the
// content size a (possibly hostile) frame header declares.
var tocDecoders = sync.Pool{New: func() any {
	d, err := zstd.NewReader(nil,
		zstd.WithDecoderConcurrency(1),
		zstd.WithDecoderLowmem(true),
		zstd.WithDecoderMaxMemory(MaxTOCRawSize),
		zstd.WithDecoderMaxWindow(MaxTOCRawSize))
	if err != nil {
		panic(err)
	}
	return d
}}

func decompressTOC(b []byte, size uint64) ([]byte, error) {
	dec := tocDecoders.Get().(*zstd.Decoder)
	defer tocDecoders.Put(dec)
	if err := dec.Reset(bytes.NewReader(b)); err != nil {
		return nil, err
	}
	buf := bytes.NewBuffer(make([]byte, 0, min(size, 8*uint64(len(b))+4096)))
	if _, err := buf.ReadFrom(io.LimitReader(dec, int64(size)+1)); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// DecodeTOC decodes the encoded TOC bytes (as stored in the blob at the
// range TOCRange returns). When expect is not empty the bytes are verified
// against it before anything else is looked at.
func DecodeTOC(b []byte, expect digest.Digest) (*TOC, error) {
	if len(b) > MaxTOCSize {
		return nil, fmt.Errorf("encoded TOC of %d bytes exceeds %d: %w", len(b), MaxTOCSize, ErrBadTOC)
	}
	if expect != "" {
		if err := verifySHA256(b, expect); err != nil {
			return nil, fmt.Errorf("verify TOC: %w", err)
		}
	}
	var h zstd.Header
	if err := h.Decode(b); err != nil || h.Skippable || !h.HasFCS || h.DictionaryID != 0 {
		return nil, fmt.Errorf("TOC is not a zstd frame with a content size: %w", ErrBadTOC)
	}
	if h.FrameContentSize < tocHeaderSize || h.FrameContentSize > MaxTOCRawSize {
		return nil, fmt.Errorf("TOC content size %d outside [%d, %d]: %w", h.FrameContentSize, tocHeaderSize, MaxTOCRawSize, ErrBadTOC)
	}
	raw, err := decompressTOC(b, h.FrameContentSize)
	if err != nil {
		return nil, fmt.Errorf("decompress TOC: %v: %w", err, ErrBadTOC)
	}
	if uint64(len(raw)) != h.FrameContentSize {
		return nil, fmt.Errorf("TOC decompressed to %d bytes, header says %d: %w", len(raw), h.FrameContentSize, ErrBadTOC)
	}
	t, err := parseTOC(raw)
	if err != nil {
		return nil, fmt.Errorf("decode TOC: %w", err)
	}
	return t, nil
}

func verifySHA256(b []byte, expect digest.Digest) error {
	if expect.Algorithm() != digest.SHA256 {
		return fmt.Errorf("unsupported digest %q: %w", expect, ErrDigestMismatch)
	}
	sum := sha256.Sum256(b)
	if got := digest.NewDigestFromBytes(digest.SHA256, sum[:]); got != expect {
		return fmt.Errorf("got %s, want %s: %w", got, expect, ErrDigestMismatch)
	}
	return nil
}

func le32(b []byte, off int) uint32 { return binary.LittleEndian.Uint32(b[off:]) }
func le64(b []byte, off int) uint64 { return binary.LittleEndian.Uint64(b[off:]) }

// parseTOC validates every record so that the accessors never index out of
// range, loop, or return a tree that is not a tree. All checks are linear in
// the TOC size.
func parseTOC(raw []byte) (*TOC, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf(format+": %w", append(args, ErrBadTOC)...)
	}
	if len(raw) < tocHeaderSize || string(raw[:8]) != tocMagic {
		return nil, bad("no TOC magic")
	}
	if v := le32(raw, 8); v != Version {
		return nil, bad("unsupported TOC version %d", v)
	}
	if f := le32(raw, 12); f != 0 {
		return nil, bad("unknown TOC flags %#x", f)
	}
	n, nc, nx, ns := uint64(le32(raw, 16)), uint64(le32(raw, 20)), uint64(le32(raw, 24)), uint64(le32(raw, 28))
	if le32(raw, 32) != entryRecSize || le32(raw, 36) != chunkRecSize || le32(raw, 40) != xattrRecSize || le32(raw, 44) != 0 || le64(raw, 56) != 0 {
		return nil, bad("unexpected record sizes or reserved fields")
	}
	if n == 0 || n > MaxEntries {
		return nil, bad("%d entries", n)
	}
	if want := tocHeaderSize + n*entryRecSize + nc*chunkRecSize + nx*xattrRecSize + ns; want != uint64(len(raw)) {
		return nil, bad("TOC is %d bytes, its counts need %d", len(raw), want)
	}
	dataEnd := le64(raw, 48)
	if dataEnd > 1<<62 {
		return nil, bad("data end %d", dataEnd)
	}
	t := &TOC{n: int(n), dataEnd: int64(dataEnd)}
	p := raw[tocHeaderSize:]
	t.entries, p = p[:n*entryRecSize], p[n*entryRecSize:]
	t.chunks, p = p[:nc*chunkRecSize], p[nc*chunkRecSize:]
	t.xattrs, p = p[:nx*xattrRecSize], p[nx*xattrRecSize:]
	t.strs = p

	str := func(off, l uint32) ([]byte, bool) {
		end := uint64(off) + uint64(l)
		if end > uint64(len(t.strs)) {
			return nil, false
		}
		return t.strs[off:end], true
	}
	var childSum, chunkNext, xattrNext uint64
	for i := 0; i < t.n; i++ {
		r := t.rec(i)
		parent, first, nch := uint64(le32(r, 0)), uint64(le32(r, 12)), uint64(le32(r, 16))
		typ, flags := EntryType(r[20]), r[21]
		name, ok := str(le32(r, 4), le32(r, 8))
		if !ok {
			return nil, bad("entry %d: name outside string table", i)
		}
		if i == 0 {
			if parent != 0 || len(name) != 0 || typ != TypeDir {
				return nil, bad("entry 0 is not the root directory")
			}
		} else if parent >= uint64(i) || !validBase(name) {
			return nil, bad("entry %d: bad parent %d or name %q", i, parent, name)
		}
		if r[22] != 0 || r[23] != 0 || le32(r, 36) != 0 || le32(r, 92) != 0 || flags&^flagImplicit != 0 {
			return nil, bad("entry %d: reserved fields set", i)
		}
		if le32(r, 24)&^unixModeMask != 0 {
			return nil, bad("entry %d: mode %#o", i, le32(r, 24))
		}
		if nsec := le32(r, 56); nsec >= 1e9 {
			return nil, bad("entry %d: nanoseconds %d", i, nsec)
		}
		if typ < TypeReg || typ > TypeFIFO {
			return nil, bad("entry %d: type %d", i, typ)
		}
		if flags&flagImplicit != 0 && typ != TypeDir {
			return nil, bad("entry %d: implicit non-directory", i)
		}
		// Children: a contiguous range after the entry itself, each child
		// pointing back, names strictly increasing. With the range after
		// the parent and the counts summing to n-1, every non-root entry
		// belongs to exactly one directory and the tree has no cycles.
		if nch != 0 {
			if typ != TypeDir || first <= uint64(i) || first+nch > n {
				return nil, bad("entry %d: children %d+%d", i, first, nch)
			}
			var prev []byte
			for c := first; c < first+nch; c++ {
				cr := t.rec(int(c))
				if uint64(le32(cr, 0)) != uint64(i) {
					return nil, bad("entry %d: child %d has parent %d", i, c, le32(cr, 0))
				}
				cn, _ := str(le32(cr, 4), le32(cr, 8)) // checked when c is visited; bounds-safe here
				if c > first && bytes.Compare(prev, cn) >= 0 {
					return nil, bad("entry %d: children not sorted or duplicated at %q", i, cn)
				}
				prev = cn
			}
			childSum += nch
		} else if first != 0 {
			return nil, bad("entry %d: first child without children", i)
		}
		// Link targets.
		link, ok := str(le32(r, 60), le32(r, 64))
		if !ok || len(link) > MaxNameLen {
			return nil, bad("entry %d: link target outside string table or too long", i)
		}
		switch typ {
		case TypeSymlink:
			if len(link) == 0 || bytes.IndexByte(link, 0) >= 0 {
				return nil, bad("entry %d: bad symlink target", i)
			}
		case TypeHardlink:
			if !validPath(link) {
				return nil, bad("entry %d: bad hard-link target %q", i, link)
			}
		default:
			if len(link) != 0 {
				return nil, bad("entry %d: link target on a %s", i, typ)
			}
		}
		if typ != TypeChar && typ != TypeBlock && (le32(r, 68) != 0 || le32(r, 72) != 0) {
			return nil, bad("entry %d: device numbers on a %s", i, typ)
		}
		// Chunks: regular files own a contiguous, in-order run of the chunk
		// table that covers the file exactly, and the runs appear in entry
		// order so that each chunk record belongs to one file.
		size, fc, ncs := le64(r, 40), uint64(le32(r, 76)), uint64(le32(r, 80))
		if typ != TypeReg && (size != 0 || ncs != 0 || fc != 0) {
			return nil, bad("entry %d: size or chunks on a %s", i, typ)
		}
		if typ == TypeReg {
			if ncs == 0 && fc != 0 {
				return nil, bad("entry %d: first chunk without chunks", i)
			}
			if ncs != 0 {
				if fc != chunkNext || fc+ncs > nc {
					return nil, bad("entry %d: chunks %d+%d", i, fc, ncs)
				}
				var fileOff uint64
				for c := fc; c < fc+ncs; c++ {
					cr := t.chunks[c*chunkRecSize:]
					off, foff, csz, sz := le64(cr, 0), le64(cr, 8), uint64(le32(cr, 16)), uint64(le32(cr, 20))
					foff2, flen := uint64(le32(cr, 24)), uint64(le32(cr, 28))
					if foff != fileOff || sz == 0 || flen > MaxChunkSize || foff2+sz > flen || csz == 0 || csz > MaxCompressedChunkSize || off+csz > dataEnd {
						return nil, bad("entry %d: chunk %d (offset %d, size %d/%d, file offset %d)", i, c, off, csz, sz, foff)
					}
					fileOff += sz
				}
				chunkNext = fc + ncs
			}
			var covered uint64
			if ncs != 0 {
				last := t.chunks[(fc+ncs-1)*chunkRecSize:]
				covered = le64(last, 8) + uint64(le32(last, 20))
			}
			if covered != size {
				return nil, bad("entry %d: chunks cover %d of %d bytes", i, covered, size)
			}
		}
		// Xattrs: an in-order run of the xattr table, keys strictly sorted.
		xf, xn := uint64(le32(r, 84)), uint64(le32(r, 88))
		if xn == 0 && xf != 0 {
			return nil, bad("entry %d: first xattr without xattrs", i)
		}
		if xn != 0 {
			if xf != xattrNext || xf+xn > nx {
				return nil, bad("entry %d: xattrs %d+%d", i, xf, xn)
			}
			var prev []byte
			for x := xf; x < xf+xn; x++ {
				xr := t.xattrs[x*xattrRecSize:]
				k, ok1 := str(le32(xr, 0), le32(xr, 4))
				v, ok2 := str(le32(xr, 8), le32(xr, 12))
				if !ok1 || !ok2 || len(k) == 0 || len(k) > maxXattrKeyLen || bytes.IndexByte(k, 0) >= 0 || len(v) > maxXattrValLen {
					return nil, bad("entry %d: bad xattr %d", i, x)
				}
				if x > xf && bytes.Compare(prev, k) >= 0 {
					return nil, bad("entry %d: xattr keys not sorted or duplicated", i)
				}
				prev = k
			}
			xattrNext = xf + xn
		}
	}
	if childSum != n-1 {
		return nil, bad("%d entries reachable from the root, want %d", childSum+1, n)
	}
	if chunkNext != nc || xattrNext != nx {
		return nil, bad("unreferenced chunk or xattr records")
	}
	return t, nil
}

// validBase reports whether b is a usable path component.
func validBase(b []byte) bool {
	return len(b) > 0 && len(b) <= MaxNameLen && !bytes.Equal(b, []byte(".")) && !bytes.Equal(b, []byte("..")) &&
		bytes.IndexByte(b, '/') < 0 && bytes.IndexByte(b, 0) < 0
}

// validPath reports whether b is a cleaned relative path of valid
// components ("." excluded).
func validPath(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for len(b) > 0 {
		i := bytes.IndexByte(b, '/')
		if i < 0 {
			return validBase(b)
		}
		if !validBase(b[:i]) {
			return false
		}
		b = b[i+1:]
	}
	return false // trailing slash
}

func (t *TOC) rec(i int) []byte { return t.entries[i*entryRecSize : (i+1)*entryRecSize] }

func (t *TOC) str(off, l uint32) []byte { return t.strs[off : uint64(off)+uint64(l)] }

// Len returns the number of entries; index 0 is the root directory ".".
func (t *TOC) Len() int { return t.n }

// DataEnd returns the blob offset where the tar frames end (the start of
// the TOC's skippable frame). Every chunk lies below it.
func (t *TOC) DataEnd() int64 { return t.dataEnd }

// Type returns the type of entry i without decoding the rest of it.
func (t *TOC) Type(i int) EntryType { return EntryType(t.rec(i)[20]) }

// Size returns the size of entry i (0 unless a regular file).
func (t *TOC) Size(i int) int64 { return int64(le64(t.rec(i), 40)) }

// BaseName returns the last path component of entry i ("." for the root).
func (t *TOC) BaseName(i int) string {
	if i == 0 {
		return "."
	}
	r := t.rec(i)
	return string(t.str(le32(r, 4), le32(r, 8)))
}

// Name returns the full cleaned path of entry i.
func (t *TOC) Name(i int) string {
	if i == 0 {
		return "."
	}
	var parts [][]byte
	size := 0
	for j := i; j != 0; j = int(le32(t.rec(j), 0)) {
		r := t.rec(j)
		b := t.str(le32(r, 4), le32(r, 8))
		parts = append(parts, b)
		size += len(b) + 1
	}
	var sb strings.Builder
	sb.Grow(size)
	for k := len(parts) - 1; k >= 0; k-- {
		sb.Write(parts[k])
		if k > 0 {
			sb.WriteByte('/')
		}
	}
	return sb.String()
}

// Mode returns the fs.FileMode of entry i (see Entry.Mode).
func (t *TOC) Mode(i int) fs.FileMode {
	r := t.rec(i)
	return fileMode(EntryType(r[20]), le32(r, 24))
}

func fileMode(typ EntryType, unix uint32) fs.FileMode {
	m := fs.FileMode(unix & 0o777)
	if unix&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if unix&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if unix&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	switch typ {
	case TypeDir:
		m |= fs.ModeDir
	case TypeSymlink:
		m |= fs.ModeSymlink
	case TypeChar:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case TypeBlock:
		m |= fs.ModeDevice
	case TypeFIFO:
		m |= fs.ModeNamedPipe
	}
	return m
}

// UnixMode returns the permission and setuid/setgid/sticky bits of entry
// i as in stat(2) (mask 07777), without type bits.
func (t *TOC) UnixMode(i int) uint32 { return le32(t.rec(i), 24) }

// Entry decodes entry i.
func (t *TOC) Entry(i int) Entry {
	r := t.rec(i)
	typ := EntryType(r[20])
	e := Entry{
		Name:     t.Name(i),
		Type:     typ,
		Mode:     fileMode(typ, le32(r, 24)),
		UID:      int(le32(r, 28)),
		GID:      int(le32(r, 32)),
		Size:     int64(le64(r, 40)),
		ModTime:  time.Unix(int64(le64(r, 48)), int64(le32(r, 56))).UTC(),
		Linkname: string(t.str(le32(r, 60), le32(r, 64))),
		Devmajor: le32(r, 68),
		Devminor: le32(r, 72),
		Implicit: r[21]&flagImplicit != 0,
	}
	if xf, xn := le32(r, 84), le32(r, 88); xn != 0 {
		e.Xattrs = make(map[string]string, xn)
		for x := xf; x < xf+xn; x++ {
			xr := t.xattrs[int(x)*xattrRecSize:]
			e.Xattrs[string(t.str(le32(xr, 0), le32(xr, 4)))] = string(t.str(le32(xr, 8), le32(xr, 12)))
		}
	}
	return e
}

// Parent returns the index of the directory holding entry i (0 for the
// root itself).
func (t *TOC) Parent(i int) int { return int(le32(t.rec(i), 0)) }

// ChildRange returns the direct children of directory entry dir as the
// index range [first, first+n), sorted by name.
func (t *TOC) ChildRange(dir int) (first, n int) {
	r := t.rec(dir)
	return int(le32(r, 12)), int(le32(r, 16))
}

// Children returns the direct children of directory entry dir, sorted by
// name.
func (t *TOC) Children(dir int) []int {
	first, n := t.ChildRange(dir)
	out := make([]int, n)
	for k := range out {
		out[k] = first + k
	}
	return out
}

// LookupChild finds the direct child of dir named base by binary search.
func (t *TOC) LookupChild(dir int, base string) (int, bool) {
	first, n := t.ChildRange(dir)
	lo, hi := first, first+n
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		r := t.rec(mid)
		switch c := strings.Compare(string(t.str(le32(r, 4), le32(r, 8))), base); {
		case c == 0:
			return mid, true
		case c < 0:
			lo = mid + 1
		default:
			hi = mid
		}
	}
	return -1, false
}

// Lookup finds an entry by its cleaned path ("." is the root). It walks
// the path one component at a time, binary-searching each directory's
// sorted children.
func (t *TOC) Lookup(name string) (int, bool) {
	if name == "." || name == "" {
		return 0, true
	}
	i := 0
	for name != "" {
		base := name
		if k := strings.IndexByte(name, '/'); k >= 0 {
			base, name = name[:k], name[k+1:]
			if name == "" {
				return -1, false // trailing slash: not a cleaned path
			}
		} else {
			name = ""
		}
		if t.Type(i) != TypeDir {
			return -1, false
		}
		var ok bool
		if i, ok = t.LookupChild(i, base); !ok {
			return -1, false
		}
	}
	return i, true
}

// maxLinkDepth bounds hard-link chains so a hostile TOC cannot make Resolve
// loop.
const maxLinkDepth = 32

// Resolve follows hard links from entry i to the entry holding the data.
// It returns i itself for anything that is not a hard link, and false when
// the target is not in this layer (OCI allows links into lower layers only
// in theory; they are refused here) or the chain is too long.
func (t *TOC) Resolve(i int) (int, bool) {
	for depth := 0; t.Type(i) == TypeHardlink; depth++ {
		if depth == maxLinkDepth {
			return -1, false
		}
		r := t.rec(i)
		j, ok := t.Lookup(string(t.str(le32(r, 60), le32(r, 64))))
		if !ok {
			return -1, false
		}
		i = j
	}
	return i, true
}

// Chunk is one contiguous piece of a regular file and the zstd frame that
// holds it. A frame decompresses independently of every other frame; small
// files share frames (with each other and with tar headers), so several
// chunks, of different files, may name the same frame: decompress through
// DecodeChunk, and never key decompressed chunk bytes by Digest alone
// (compressed bytes are fine: they are the frame).
type Chunk struct {
	Offset         int64 // offset of the compressed frame in the blob
	CompressedSize int64 // size of the compressed frame
	FileOffset     int64 // offset of the chunk's first byte in the file
	Size           int64 // uncompressed size of the chunk
	// Digest is the sha256 of the compressed frame bytes
	// blob[Offset:Offset+CompressedSize].
	Digest digest.Digest
	// FrameOffset is where the chunk's bytes start in the decompressed
	// frame, and FrameSize the decompressed size of the whole frame
	// (FrameOffset+Size <= FrameSize <= MaxChunkSize).
	FrameOffset, FrameSize int64
}

// NumChunks returns the number of chunks of entry i.
func (t *TOC) NumChunks(i int) int { return int(le32(t.rec(i), 80)) }

// Chunk returns chunk k (0 <= k < NumChunks(i)) of entry i.
func (t *TOC) Chunk(i, k int) Chunk {
	c := int(le32(t.rec(i), 76)) + k
	cr := t.chunks[c*chunkRecSize : (c+1)*chunkRecSize]
	return Chunk{
		Offset:         int64(le64(cr, 0)),
		FileOffset:     int64(le64(cr, 8)),
		CompressedSize: int64(le32(cr, 16)),
		Size:           int64(le32(cr, 20)),
		FrameOffset:    int64(le32(cr, 24)),
		FrameSize:      int64(le32(cr, 28)),
		Digest:         sha256Digest(cr[32:64]),
	}
}

// sha256Digest formats raw sha256 bytes as a digest; go-digest's own
// constructor goes through fmt and dominated small-read profiles.
func sha256Digest(sum []byte) digest.Digest {
	var b [7 + 64]byte
	copy(b[:], "sha256:")
	hex.Encode(b[7:], sum)
	return digest.Digest(b[:])
}

// Chunks returns the chunks of regular file i in file order (empty for
// empty files and every other type; for hard links use Resolve first).
func (t *TOC) Chunks(i int) []Chunk {
	n := t.NumChunks(i)
	out := make([]Chunk, n)
	for k := range out {
		out[k] = t.Chunk(i, k)
	}
	return out
}

// ChunkAt returns the index of the chunk of entry i holding file offset
// off, or -1 when off is outside the file.
func (t *TOC) ChunkAt(i int, off int64) int {
	n := t.NumChunks(i)
	if off < 0 || off >= t.Size(i) || n == 0 {
		return -1
	}
	base := int(le32(t.rec(i), 76))
	lo, hi := 0, n
	for hi-lo > 1 {
		mid := int(uint(lo+hi) >> 1)
		if int64(le64(t.chunks[(base+mid)*chunkRecSize:], 8)) <= off {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// chunkGeometry returns chunk k of entry i without formatting its digest.
func (t *TOC) chunkGeometry(i, k int) (off, fileOff, size, frameOff, frameSize int64) {
	c := int(le32(t.rec(i), 76)) + k
	cr := t.chunks[c*chunkRecSize : (c+1)*chunkRecSize]
	return int64(le64(cr, 0)), int64(le64(cr, 8)), int64(le32(cr, 20)), int64(le32(cr, 24)), int64(le32(cr, 28))
}
