package agent

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
)

// accounts caches the account files: they are read-only in a sandbox, and
// reading them on every request would block an OS thread each time, which a
// sandbox whose workload holds every other pid cannot afford.
var accounts sync.Map // path -> []byte

func readAccounts(path string) ([]byte, error) {
	if v, ok := accounts.Load(path); ok {
		return v.([]byte), nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	accounts.Store(path, data)
	return data, nil
}

// User is an account inside the sandbox, read from the sandbox's /etc/passwd.
type User struct {
	Name string
	UID  int
	GID  int
	Home string
}

// LookupUser finds name in passwd (the sandbox's /etc/passwd). A numeric name
// that is not listed is accepted as a bare uid with gid = uid and home "/".
func LookupUser(passwd, name string) (User, error) {
	if name == "" {
		return User{}, fmt.Errorf("empty user name")
	}
	if data, err := readAccounts(passwd); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			fields := strings.Split(line, ":")
			if len(fields) < 7 || fields[0] != name {
				continue
			}
			uid, err1 := strconv.Atoi(fields[2])
			gid, err2 := strconv.Atoi(fields[3])
			if err1 != nil || err2 != nil {
				return User{}, fmt.Errorf("user %q: malformed passwd entry", name)
			}
			return User{Name: name, UID: uid, GID: gid, Home: fields[5]}, nil
		}
	}
	if n, err := strconv.Atoi(name); err == nil && n >= 0 {
		return User{Name: name, UID: n, GID: n, Home: "/"}, nil
	}
	return User{}, fmt.Errorf("user %q does not exist in the sandbox", name)
}

// lookupName returns the name for id in an /etc/passwd- or /etc/group-shaped
// file, or the number itself when it is not listed.
func lookupName(file string, id uint32) string {
	data, err := readAccounts(file)
	if err == nil {
		want := strconv.FormatUint(uint64(id), 10)
		for _, line := range strings.Split(string(data), "\n") {
			fields := strings.Split(line, ":")
			if len(fields) >= 3 && fields[2] == want {
				return fields[0]
			}
		}
	}
	return strconv.FormatUint(uint64(id), 10)
}
