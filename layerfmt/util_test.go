package layerfmt

import (
	"crypto/sha256"

	"github.com/opencontainers/go-digest"
)

func digestOf(b []byte) digest.Digest {
	s := sha256.Sum256(b)
	return digest.NewDigestFromBytes(digest.SHA256, s[:])
}

func digestFromString(s string) digest.Digest { return digest.Digest(s) }
