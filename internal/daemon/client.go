package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
)

// GetStatus asks a running daemon for its status. address is the
// daemon's gRPC socket path; the status is served on the root-only unix
// socket beside it (StatusSocket), never on the TCP metrics address.
func GetStatus(ctx context.Context, address string) (Status, error) {
	var st Status
	err := get(ctx, address, "/status", &st)
	return st, err
}

// GetFootprints asks a running daemon for the footprints of the layers it
// serves: layer digest -> layerfmt.AnnotationPrefetch value (see
// layerstore.Store.Footprints). address is as for GetStatus.
func GetFootprints(ctx context.Context, address string) (map[string]string, error) {
	var fp map[string]string
	err := get(ctx, address, "/footprints", &fp)
	return fp, err
}

func get(ctx context.Context, address, path string, v any) error {
	if strings.Contains(address, "://") {
		return fmt.Errorf("query daemon %s: %q is not a socket path: status and footprints are served only on the daemon's unix socket (give its gRPC socket, e.g. %s)", path, address, DefaultAddress)
	}
	sock := StatusSocket(address)
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://envsnap"+path, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("query daemon %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// The body says why (503: "not ready: restoring layer mounts").
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("query daemon %s: %s: %s", path, resp.Status, strings.TrimSpace(string(b)))
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("decode daemon %s: %w", path, err)
	}
	return nil
}
