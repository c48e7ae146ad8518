// Package layerfmt implements the envsnap lazy layer format: an OCI
// tar+zstd layer blob in which every regular file's bytes are split into
// independently decompressible zstd frames ("chunks"), followed by a binary,
// indexable table of contents (TOC) and a fixed-size footer, both stored in
// zstd skippable frames.
//
// The main invariant: decompressing the whole blob with any zstd decoder
// yields exactly the tar stream whose sha256 is the layer's diffID, so a
// plain containerd pulls and unpacks it as an ordinary
// application/vnd.oci.image.layer.v1.tar+zstd layer, while a lazy reader
// finds all metadata with one size query and at most two range reads at the
// tail, and every byte it serves is verified against a chunk digest that
// chains up to the TOC digest in the layer descriptor's annotations.
//
// The byte-level specification is docs/layer-format.md.
package layerfmt

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/opencontainers/go-digest"
)

// MediaTypeLayer is the media type of converted layers. The blobs are valid
// zstd-compressed tar streams, so the standard media type is used.
const MediaTypeLayer = "application/vnd.oci.image.layer.v1.tar+zstd"

// Annotations put on the OCI layer descriptor of a converted layer.
const (
	// AnnotationTOCDigest is the sha256 of the encoded TOC bytes; it is the
	// trust root of every lazily read byte.
	AnnotationTOCDigest = "io.envsnap.layer.toc.digest"
	// AnnotationTOCSize is the size of the encoded TOC bytes, in decimal.
	AnnotationTOCSize = "io.envsnap.layer.toc.size"
	// AnnotationVersion is the format version, "1".
	AnnotationVersion = "io.envsnap.layer.version"
)

// Version is the format version written by this package.
const Version = 1

// Errors returned (wrapped with context) by the readers. Callers branch on
// them with errors.Is.
var (
	// ErrNotLayer: the blob or descriptor is not in this format.
	ErrNotLayer = errors.New("not an envsnap layer")
	// ErrBadFooter: the footer is corrupt or inconsistent with the blob.
	ErrBadFooter = errors.New("bad envsnap layer footer")
	// ErrBadTOC: the TOC is malformed or violates a limit.
	ErrBadTOC = errors.New("bad envsnap layer TOC")
	// ErrDigestMismatch: bytes do not match the digest that vouches for them.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrTruncated: the blob is shorter than its metadata says.
	ErrTruncated = errors.New("truncated envsnap layer")
)

// Limits enforced on untrusted input. They bound the memory and CPU a
// hostile blob can make a reader spend.
const (
	// MaxTOCSize bounds the encoded (compressed) TOC.
	MaxTOCSize = 256 << 20
	// MaxTOCRawSize bounds the decompressed TOC (about 1.5 million entries).
	MaxTOCRawSize = 256 << 20
	// MaxChunkSize bounds the uncompressed size of one chunk.
	MaxChunkSize = 64 << 20
	// MaxCompressedChunkSize bounds the compressed size of one chunk
	// (zstd's worst-case expansion of MaxChunkSize is far below this).
	MaxCompressedChunkSize = MaxChunkSize + MaxChunkSize/64 + 1<<16
	// MaxNameLen bounds one path component and symlink targets.
	MaxNameLen = 4096
	// MaxEntries bounds the number of TOC entries.
	MaxEntries = 1 << 22
)

// zstd skippable frame magics (RFC 8878 section 3.1.2 allows 0x184D2A50 to
// 0x184D2A5F). Distinct values keep our frames apart from other formats'
// (zstd:chunked uses 0x184D2A50).
const (
	skippableTOCMagic    = 0x184D2A5E
	skippableFooterMagic = 0x184D2A5F
	skippableHeaderSize  = 8
)

const (
	footerMagic       = "ESNAPFT1"
	footerPayloadSize = 72
	// FooterSize is the size of the footer frame at the very end of every
	// blob: an 8-byte skippable frame header plus a 72-byte payload.
	FooterSize = skippableHeaderSize + footerPayloadSize
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// footer is the decoded footer payload.
type footer struct {
	tocOffset int64 // blob offset of the first encoded TOC byte
	tocSize   int64 // length of the encoded TOC
	tocDigest digest.Digest
}

func (f footer) marshal() []byte {
	b := make([]byte, FooterSize)
	binary.LittleEndian.PutUint32(b[0:], skippableFooterMagic)
	binary.LittleEndian.PutUint32(b[4:], footerPayloadSize)
	p := b[skippableHeaderSize:]
	copy(p[0:8], footerMagic)
	binary.LittleEndian.PutUint32(p[8:], Version)
	binary.LittleEndian.PutUint32(p[12:], 0) // flags
	binary.LittleEndian.PutUint64(p[16:], uint64(f.tocOffset))
	binary.LittleEndian.PutUint64(p[24:], uint64(f.tocSize))
	copy(p[32:64], mustHex(f.tocDigest))
	binary.LittleEndian.PutUint32(p[64:], crc32.Checksum(p[:64], castagnoli))
	binary.LittleEndian.PutUint32(p[68:], 0) // reserved
	return b
}

// parseFooter decodes and validates a footer against the blob size.
func parseFooter(b []byte, blobSize int64) (footer, error) {
	var f footer
	if len(b) != FooterSize {
		return f, fmt.Errorf("footer is %d bytes, want %d: %w", len(b), FooterSize, ErrBadFooter)
	}
	if blobSize < FooterSize+skippableHeaderSize {
		return f, fmt.Errorf("blob of %d bytes is too small for a footer: %w", blobSize, ErrNotLayer)
	}
	p := b[skippableHeaderSize:]
	if binary.LittleEndian.Uint32(b[0:]) != skippableFooterMagic || string(p[0:8]) != footerMagic {
		return f, fmt.Errorf("no footer magic: %w", ErrNotLayer)
	}
	if binary.LittleEndian.Uint32(b[4:]) != footerPayloadSize {
		return f, fmt.Errorf("footer frame size %d: %w", binary.LittleEndian.Uint32(b[4:]), ErrBadFooter)
	}
	if got, want := crc32.Checksum(p[:64], castagnoli), binary.LittleEndian.Uint32(p[64:]); got != want {
		return f, fmt.Errorf("footer crc32c %08x, recorded %08x: %w", got, want, ErrBadFooter)
	}
	if v := binary.LittleEndian.Uint32(p[8:]); v != Version {
		return f, fmt.Errorf("unsupported format version %d: %w", v, ErrBadFooter)
	}
	if fl := binary.LittleEndian.Uint32(p[12:]); fl != 0 {
		return f, fmt.Errorf("unknown footer flags %#x: %w", fl, ErrBadFooter)
	}
	if r := binary.LittleEndian.Uint32(p[68:]); r != 0 {
		return f, fmt.Errorf("reserved footer field %#x: %w", r, ErrBadFooter)
	}
	off, size := binary.LittleEndian.Uint64(p[16:]), binary.LittleEndian.Uint64(p[24:])
	if size == 0 || size > MaxTOCSize {
		return f, fmt.Errorf("TOC size %d outside (0, %d]: %w", size, MaxTOCSize, ErrBadFooter)
	}
	// The TOC frame sits immediately before the footer frame.
	if off < skippableHeaderSize || off+size != uint64(blobSize-FooterSize) {
		return f, fmt.Errorf("TOC range %d+%d does not end at the footer (blob %d bytes): %w", off, size, blobSize, ErrBadFooter)
	}
	f.tocOffset, f.tocSize = int64(off), int64(size)
	f.tocDigest = sha256Digest(p[32:64])
	return f, nil
}

// mustHex returns the 32 raw bytes of a sha256 digest this package made.
func mustHex(d digest.Digest) []byte {
	b, err := hex.DecodeString(d.Encoded())
	if err != nil || len(b) != 32 {
		panic(fmt.Sprintf("layerfmt: not a sha256 digest: %q", d))
	}
	return b
}

// TOCRange decodes a footer (the last FooterSize bytes of a blob of
// blobSize bytes) and returns where the encoded TOC lies in the blob.
func TOCRange(footer []byte, blobSize int64) (off, size int64, err error) {
	f, err := parseFooter(footer, blobSize)
	if err != nil {
		return 0, 0, err
	}
	return f.tocOffset, f.tocSize, nil
}
