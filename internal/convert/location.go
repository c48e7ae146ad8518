package convert

import (
	"fmt"
	"strings"

	"github.com/distribution/reference"
)

// Kind is where an image is read from or written to.
type Kind int

const (
	// Registry is an image reference in a registry (host/repo:tag or @digest).
	Registry Kind = iota
	// Layout is an OCI image layout directory (buildctl --output type=oci,tar=false).
	Layout
	// Archive is a tar of an OCI image layout, as written by
	// buildctl --output type=oci and ctr images export (which adds Docker's
	// manifest.json; both are read).
	Archive
	// Containerd is an image in a containerd's image and content stores
	// (source only): Ref is the image name as `ctr images ls` shows it.
	Containerd
)

// Location names an image source or destination.
type Location struct {
	Kind Kind
	// Ref is the normalised registry reference (Registry), or the optional
	// name recorded in (or selected from) a layout's index.json.
	Ref string
	// Path is the layout directory or archive file.
	Path string
}

func (l Location) String() string {
	switch l.Kind {
	case Layout:
		return "oci-layout:" + l.Path
	case Archive:
		return "oci-archive:" + l.Path
	case Containerd:
		return "containerd:" + l.Ref
	}
	return l.Ref
}

// ParseLocation parses "oci-layout:DIR", "oci-archive:FILE.tar",
// "containerd:NAME" or a registry reference (normalised as containerd does:
// "alpine" means docker.io/library/alpine:latest).
func ParseLocation(s string) (Location, error) {
	switch {
	case strings.HasPrefix(s, "containerd:"):
		n := strings.TrimPrefix(s, "containerd:")
		if n == "" {
			return Location{}, fmt.Errorf("%q: empty image name", s)
		}
		return Location{Kind: Containerd, Ref: n}, nil
	case strings.HasPrefix(s, "oci-layout:"):
		p := strings.TrimPrefix(s, "oci-layout:")
		if p == "" {
			return Location{}, fmt.Errorf("%q: empty layout path", s)
		}
		return Location{Kind: Layout, Path: p}, nil
	case strings.HasPrefix(s, "oci-archive:"):
		p := strings.TrimPrefix(s, "oci-archive:")
		if p == "" {
			return Location{}, fmt.Errorf("%q: empty archive path", s)
		}
		return Location{Kind: Archive, Path: p}, nil
	}
	named, err := reference.ParseDockerRef(s)
	if err != nil {
		return Location{}, fmt.Errorf("parse image reference %q: %w", s, err)
	}
	return Location{Kind: Registry, Ref: named.String()}, nil
}

// hostAndRepo returns the repository path of a registry reference
// and its host, for cross-repository blob mounts.
func hostAndRepo(ref string) (host, repo string, err error) {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		return "", "", err
	}
	return reference.Domain(named), reference.Path(named), nil
}
