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

// Raw TOC layout; see docs/layer-format.md. Offsets are of little-endian
// fields within each fixed-size record.
const (
	tocMagic       = "ESNAPTOC"
	tocHeaderSize  = 64
	entryRecSize   = 72
	chunkRecSize   = 24
	frameRecSize   = 48
	xattrRecSize   = 16
	flagImplicit   = 1
	unixModeMask   = 0o7777
	maxXattrKeyLen = 255
	maxXattrValLen = 1 << 16

	// entry record
	eParent   = 0  // u32 index of the parent directory (0 for the root)
	eNameOff  = 4  // u32 base name in the string table
	eNameLen  = 8  // u32
	eType     = 12 // u8 EntryType
	eFlags    = 13 // u8 flagImplicit
	eReserved = 14 // u16 zero
	eMode     = 16 // u32 permission, setuid, setgid, sticky bits
	eUID      = 20 // u32
	eGID      = 24 // u32
	eNsec     = 28 // u32 mtime nanoseconds
	eMtime    = 32 // i64 mtime seconds since the Unix epoch
	eSize     = 40 // u64 regular file size
	eA        = 48 // u32 first child | first chunk | device major
	eB        = 52 // u32 child count | chunk count | device minor
	eLinkOff  = 56 // u32 link target in the string table
	eLinkLen  = 60 // u32
	eXattrOff = 64 // u32 first xattr record
	eXattrN   = 68 // u32 xattr count

	// chunk record
	cFileOff  = 0  // u64 offset in the file
	cFrame    = 8  // u32 frame index
	cFrameOff = 12 // u32 offset in the decompressed frame
	cSize     = 16 // u32 size
	cReserved = 20 // u32 zero

	// frame record
	fOffset = 0  // u64 blob offset
	fCSize  = 8  // u32 compressed size
	fSize   = 12 // u32 decompressed size
	fDigest = 16 // [32]byte sha256 of the compressed frame
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
	frames  []byte
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
	// Trust the declared size up to a generous compression ratio (real
	// TOCs compress 10-40x); beyond that, grow with the actual output.
	buf := bytes.NewBuffer(make([]byte, 0, min(size+bytes.MinRead, max(1<<20, 128*uint64(len(b))))))
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
	n, nc, nf, nx, ns := uint64(le32(raw, 16)), uint64(le32(raw, 20)), uint64(le32(raw, 24)), uint64(le32(raw, 28)), uint64(le32(raw, 32))
	if le32(raw, 36) != entryRecSize || le32(raw, 40) != chunkRecSize || le32(raw, 44) != frameRecSize || le32(raw, 48) != xattrRecSize || le32(raw, 52) != 0 {
		return nil, bad("unexpected record sizes or reserved fields")
	}
	if n == 0 || n > MaxEntries {
		return nil, bad("%d entries", n)
	}
	if want := tocHeaderSize + n*entryRecSize + nc*chunkRecSize + nf*frameRecSize + nx*xattrRecSize + ns; want != uint64(len(raw)) {
		return nil, bad("TOC is %d bytes, its counts need %d", len(raw), want)
	}
	dataEnd := le64(raw, 56)
	if dataEnd > 1<<62 {
		return nil, bad("data end %d", dataEnd)
	}
	t := &TOC{n: int(n), dataEnd: int64(dataEnd)}
	p := raw[tocHeaderSize:]
	t.entries, p = p[:n*entryRecSize], p[n*entryRecSize:]
	t.chunks, p = p[:nc*chunkRecSize], p[nc*chunkRecSize:]
	t.frames, p = p[:nf*frameRecSize], p[nf*frameRecSize:]
	t.xattrs, p = p[:nx*xattrRecSize], p[nx*xattrRecSize:]
	t.strs = p

	// Frames tile the data region [0, dataEnd) in blob order.
	var pos uint64
	for k := uint64(0); k < nf; k++ {
		fr := t.frames[k*frameRecSize:]
		off, csz, sz := le64(fr, fOffset), uint64(le32(fr, fCSize)), uint64(le32(fr, fSize))
		if off != pos || csz == 0 || csz > MaxCompressedChunkSize || sz == 0 || sz > MaxChunkSize {
			return nil, bad("frame %d: offset %d (want %d), sizes %d/%d", k, off, pos, csz, sz)
		}
		pos += csz
	}
	if pos != dataEnd {
		return nil, bad("frames cover %d of %d data bytes", pos, dataEnd)
	}

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
		parent, a, b := uint64(le32(r, eParent)), uint64(le32(r, eA)), uint64(le32(r, eB))
		typ, flags := EntryType(r[eType]), r[eFlags]
		name, ok := str(le32(r, eNameOff), le32(r, eNameLen))
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
		if r[eReserved] != 0 || r[eReserved+1] != 0 || flags&^flagImplicit != 0 {
			return nil, bad("entry %d: reserved fields set", i)
		}
		if le32(r, eMode)&^unixModeMask != 0 {
			return nil, bad("entry %d: mode %#o", i, le32(r, eMode))
		}
		if nsec := le32(r, eNsec); nsec >= 1e9 {
			return nil, bad("entry %d: nanoseconds %d", i, nsec)
		}
		if typ < TypeReg || typ > TypeFIFO {
			return nil, bad("entry %d: type %d", i, typ)
		}
		if flags&flagImplicit != 0 && typ != TypeDir {
			return nil, bad("entry %d: implicit non-directory", i)
		}
		size := le64(r, eSize)
		if typ != TypeReg && size != 0 {
			return nil, bad("entry %d: size on a %s", i, typ)
		}
		switch typ {
		case TypeDir:
			// Children: a contiguous range after the entry itself, each
			// child pointing back, names strictly increasing. With the
			// range after the parent and the counts summing to n-1, every
			// non-root entry belongs to exactly one directory and the
			// tree has no cycles.
			if b == 0 {
				if a != 0 {
					return nil, bad("entry %d: first child without children", i)
				}
				break
			}
			if a <= uint64(i) || a+b > n {
				return nil, bad("entry %d: children %d+%d", i, a, b)
			}
			var prev []byte
			for c := a; c < a+b; c++ {
				cr := t.rec(int(c))
				if uint64(le32(cr, eParent)) != uint64(i) {
					return nil, bad("entry %d: child %d has parent %d", i, c, le32(cr, eParent))
				}
				cn, _ := str(le32(cr, eNameOff), le32(cr, eNameLen)) // bounds checked when c is visited
				if c > a && bytes.Compare(prev, cn) >= 0 {
					return nil, bad("entry %d: children not sorted or duplicated at %q", i, cn)
				}
				prev = cn
			}
			childSum += b
		case TypeReg:
			// Chunks: a contiguous run of the chunk table, in entry order
			// (so each chunk record belongs to one file), tiling the file.
			if b == 0 && a != 0 {
				return nil, bad("entry %d: first chunk without chunks", i)
			}
			if b != 0 && (a != chunkNext || a+b > nc) {
				return nil, bad("entry %d: chunks %d+%d", i, a, b)
			}
			var fileOff uint64
			for c := a; c < a+b; c++ {
				cr := t.chunks[c*chunkRecSize:]
				foff, fr, froff, sz := le64(cr, cFileOff), uint64(le32(cr, cFrame)), uint64(le32(cr, cFrameOff)), uint64(le32(cr, cSize))
				if foff != fileOff || sz == 0 || fr >= nf || froff+sz > uint64(le32(t.frames[fr*frameRecSize:], fSize)) || le32(cr, cReserved) != 0 {
					return nil, bad("entry %d: chunk %d (file offset %d, frame %d+%d, size %d)", i, c, foff, fr, froff, sz)
				}
				fileOff += sz
			}
			if fileOff != size {
				return nil, bad("entry %d: chunks cover %d of %d bytes", i, fileOff, size)
			}
			chunkNext += b
		case TypeChar, TypeBlock:
			// a, b are the device numbers.
		default:
			if a != 0 || b != 0 {
				return nil, bad("entry %d: children, chunks or device numbers on a %s", i, typ)
			}
		}
		link, ok := str(le32(r, eLinkOff), le32(r, eLinkLen))
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
		// Xattrs: an in-order run of the xattr table, keys strictly sorted.
		xf, xn := uint64(le32(r, eXattrOff)), uint64(le32(r, eXattrN))
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

// xattr returns the name and value of extended attribute record x, which
// parseTOC checked.
func (t *TOC) xattr(x uint32) (name, value []byte) {
	xr := t.xattrs[int(x)*xattrRecSize:]
	return t.str(le32(xr, 0), le32(xr, 4)), t.str(le32(xr, 8), le32(xr, 12))
}

// Len returns the number of entries; index 0 is the root directory ".".
func (t *TOC) Len() int { return t.n }

// DataEnd returns the blob offset where the tar frames end (the start of
// the TOC's skippable frame). Every chunk lies below it.
func (t *TOC) DataEnd() int64 { return t.dataEnd }

// Type returns the type of entry i without decoding the rest of it.
func (t *TOC) Type(i int) EntryType { return EntryType(t.rec(i)[eType]) }

// Size returns the size of entry i (0 unless a regular file).
func (t *TOC) Size(i int) int64 { return int64(le64(t.rec(i), eSize)) }

// BaseName returns the last path component of entry i ("." for the root).
func (t *TOC) BaseName(i int) string {
	if i == 0 {
		return "."
	}
	r := t.rec(i)
	return string(t.str(le32(r, eNameOff), le32(r, eNameLen)))
}

// Name returns the full cleaned path of entry i.
func (t *TOC) Name(i int) string {
	if i == 0 {
		return "."
	}
	var parts [][]byte
	size := 0
	for j := i; j != 0; j = int(le32(t.rec(j), eParent)) {
		r := t.rec(j)
		b := t.str(le32(r, eNameOff), le32(r, eNameLen))
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
	return fileMode(EntryType(r[eType]), le32(r, eMode))
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
func (t *TOC) UnixMode(i int) uint32 { return le32(t.rec(i), eMode) }

// Entry decodes entry i.
func (t *TOC) Entry(i int) Entry {
	r := t.rec(i)
	typ := EntryType(r[eType])
	e := Entry{
		Name:     t.Name(i),
		Type:     typ,
		Mode:     fileMode(typ, le32(r, eMode)),
		UID:      int(le32(r, eUID)),
		GID:      int(le32(r, eGID)),
		Size:     int64(le64(r, eSize)),
		ModTime:  time.Unix(int64(le64(r, eMtime)), int64(le32(r, eNsec))).UTC(),
		Linkname: string(t.str(le32(r, eLinkOff), le32(r, eLinkLen))),
		Implicit: r[eFlags]&flagImplicit != 0,
	}
	if typ == TypeChar || typ == TypeBlock {
		e.Devmajor, e.Devminor = le32(r, eA), le32(r, eB)
	}
	if xf, xn := le32(r, eXattrOff), le32(r, eXattrN); xn != 0 {
		e.Xattrs = make(map[string]string, xn)
		for x := xf; x < xf+xn; x++ {
			k, v := t.xattr(x)
			e.Xattrs[string(k)] = string(v)
		}
	}
	return e
}

// Parent returns the index of the directory holding entry i (0 for the
// root itself).
func (t *TOC) Parent(i int) int { return int(le32(t.rec(i), eParent)) }

// ChildRange returns the direct children of directory entry dir as the
// index range [first, first+n), sorted by name.
func (t *TOC) ChildRange(dir int) (first, n int) {
	r := t.rec(dir)
	if EntryType(r[eType]) != TypeDir {
		return 0, 0
	}
	return int(le32(r, eA)), int(le32(r, eB))
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
		switch c := compareBytesString(t.str(le32(r, eNameOff), le32(r, eNameLen)), base); {
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
		j, ok := t.Lookup(string(t.str(le32(r, eLinkOff), le32(r, eLinkLen))))
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
	// FrameIndex is the frame's index in the TOC's frame table.
	FrameIndex int
}

// NumChunks returns the number of chunks of entry i.
func (t *TOC) NumChunks(i int) int {
	r := t.rec(i)
	if EntryType(r[eType]) != TypeReg {
		return 0
	}
	return int(le32(r, eB))
}

// Chunk returns chunk k (0 <= k < NumChunks(i)) of entry i.
func (t *TOC) Chunk(i, k int) Chunk {
	c := t.chunkGeometry(i, k)
	c.Digest = sha256Digest(t.frames[c.FrameIndex*frameRecSize+fDigest:][:32])
	return c
}

// chunkGeometry returns chunk k of entry i without formatting its digest.
func (t *TOC) chunkGeometry(i, k int) Chunk {
	cr := t.chunks[(int(le32(t.rec(i), eA))+k)*chunkRecSize:][:chunkRecSize]
	fi := int(le32(cr, cFrame))
	fr := t.frames[fi*frameRecSize:][:frameRecSize]
	return Chunk{
		Offset:         int64(le64(fr, fOffset)),
		CompressedSize: int64(le32(fr, fCSize)),
		FileOffset:     int64(le64(cr, cFileOff)),
		Size:           int64(le32(cr, cSize)),
		FrameOffset:    int64(le32(cr, cFrameOff)),
		FrameSize:      int64(le32(fr, fSize)),
		FrameIndex:     fi,
	}
}

// Frame is one zstd frame of the blob's data region. The frames tile
// [0, DataEnd()) in order; decompressed and concatenated they are the
// uncompressed tar stream (the diffID's preimage), so a reader can verify
// and reassemble the whole tar from frames alone.
type Frame struct {
	Offset         int64
	CompressedSize int64
	Size           int64 // decompressed
	Digest         digest.Digest
}

// NumFrames returns the number of frames in the data region.
func (t *TOC) NumFrames() int { return len(t.frames) / frameRecSize }

// Frame returns frame k.
func (t *TOC) Frame(k int) Frame {
	fr := t.frames[k*frameRecSize:][:frameRecSize]
	return Frame{
		Offset:         int64(le64(fr, fOffset)),
		CompressedSize: int64(le32(fr, fCSize)),
		Size:           int64(le32(fr, fSize)),
		Digest:         sha256Digest(fr[fDigest : fDigest+32]),
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
	base := int(le32(t.rec(i), eA))
	lo, hi := 0, n
	for hi-lo > 1 {
		mid := int(uint(lo+hi) >> 1)
		if int64(le64(t.chunks[(base+mid)*chunkRecSize:], cFileOff)) <= off {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// compareBytesString is bytes.Compare(b, []byte(s)) without converting.
func compareBytesString(b []byte, s string) int {
	n := min(len(b), len(s))
	for k := 0; k < n; k++ {
		if b[k] != s[k] {
			if b[k] < s[k] {
				return -1
			}
			return 1
		}
	}
	switch {
	case len(b) < len(s):
		return -1
	case len(b) > len(s):
		return 1
	}
	return 0
}
